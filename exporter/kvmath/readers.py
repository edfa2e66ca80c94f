"""A `KVLayout` from a Hugging Face config.json (`layout_from_config_json`) or from the explicit
numbers of a target's `model_architecture:` section (`layout_from_mapping`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .layout import AUTO, ArchitectureError, KVLayout, RecurrentState, canonical_dtype, require_int

# Per-layer kinds a config can declare.
_FULL, _SLIDING, _RECURRENT, _NO_CACHE = "full", "sliding", "recurrent", "none"
# Entries of `layer_types` (Gemma 2/3, GPT-OSS, Qwen3-Next, Granite 4) and `layers_block_type`
# (Jamba-style, newer Nemotron-H).
_LAYER_TYPE_KINDS = {
    "full_attention": _FULL, "attention": _FULL, "global_attention": _FULL,
    "sliding_attention": _SLIDING, "local_attention": _SLIDING,
    "mamba": _RECURRENT, "mamba2": _RECURRENT, "linear_attention": _RECURRENT,
    "mlp": _NO_CACHE, "moe": _NO_CACHE,
}
# Nemotron-H's `hybrid_override_pattern`: one character per layer.
_PATTERN_KINDS = {"*": _FULL, "M": _RECURRENT, "-": _NO_CACHE, "E": _NO_CACHE}
# Interleaving that Hugging Face's model code applies when a config sets `sliding_window` but
# neither `layer_types` nor `sliding_window_pattern`: layer i slides unless (i + 1) % P == 0.
_DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}



class _Reader:
    """Typed look-ups in a config mapping; errors name the key with its path prefix."""

    def __init__(self, values: Mapping[str, Any], prefix: str = ""):
        self.values = values
        self.prefix = prefix

    def error(self, key: str, problem: str) -> ArchitectureError:
        return ArchitectureError(self.prefix + key, problem)

    def find(self, *names: str) -> tuple[str, Any]:
        """The first of names whose value is not null; (names[0], None) if none is."""
        for name in names:
            if self.values.get(name) is not None:
                return name, self.values[name]
        return names[0], None

    def optional_int(self, *names: str, minimum: int = 1) -> int | None:
        key, value = self.find(*names)
        return None if value is None else require_int(value, self.prefix + key, minimum)

    def required_int(self, *names: str) -> int:
        value = self.optional_int(*names)
        if value is None:
            raise self.error(names[0], "missing")
        return value

    def dtype(self, *names: str, default: str, allow_auto: bool = False) -> str:
        key, value = self.find(*names)
        return default if value is None else canonical_dtype(value, self.prefix + key, allow_auto)


@dataclass(frozen=True)
class _HeadNames:
    """Where a mapping keeps the attention geometry (a config.json and the YAML spell it apart)."""

    heads: tuple[str, ...]
    kv_heads: tuple[str, ...]
    head_dim: tuple[str, ...]
    hidden: tuple[str, ...]


_CONFIG_HEAD_NAMES = _HeadNames(
    heads=("num_attention_heads", "n_head"),
    kv_heads=("num_key_value_heads", "num_kv_heads"),
    head_dim=("head_dim", "attention_head_dim"),
    hidden=("hidden_size", "n_embd"),
)
_MAPPING_HEAD_NAMES = _HeadNames(
    heads=("attention_heads",), kv_heads=("kv_heads",), head_dim=("head_dim",), hidden=("hidden_size",)
)


def _kv_geometry(reader: _Reader, names: _HeadNames, multi_query: bool = False) -> tuple[int, int]:
    """(KV heads, head dim): KV heads default to the attention heads (1 for multi-query),
    head dim to hidden size / attention heads."""
    heads = reader.optional_int(*names.heads)
    kv_heads = reader.optional_int(*names.kv_heads)
    if kv_heads is None:
        kv_heads = 1 if multi_query else heads
    if kv_heads is None:
        raise reader.error(names.kv_heads[0], f"missing, and no {names.heads[0]} to default to")
    head_dim = reader.optional_int(*names.head_dim)
    if head_dim is None:
        hidden = reader.optional_int(*names.hidden)
        if hidden is None or heads is None:
            lacking = names.hidden[0] if hidden is None else names.heads[0]
            raise reader.error(names.head_dim[0], f"missing, and no {lacking} to derive it from")
        if hidden % heads:
            raise reader.error(names.hidden[0], f"{hidden} is not a multiple of {names.heads[0]} ({heads})")
        head_dim = hidden // heads
    return kv_heads, head_dim


def _load_config(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    if path.is_dir():  # a model snapshot directory
        path = path / "config.json"
    if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
        raise ArchitectureError("config_json", f"{path} is not a regular file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ArchitectureError("config_json", f"cannot read {path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArchitectureError("config_json", f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ArchitectureError("config_json", f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _kinds_from_list(reader: _Reader, key: str, layers: int) -> list[str]:
    entries = reader.values[key]
    if not isinstance(entries, list) or len(entries) != layers:
        size = len(entries) if isinstance(entries, list) else "no"
        raise reader.error(key, f"must list one entry per layer: {size} entries for {layers} layers")
    kinds = []
    for index, entry in enumerate(entries):
        kind = _LAYER_TYPE_KINDS.get(entry) if isinstance(entry, str) else None
        if kind is None:
            known = ", ".join(sorted(_LAYER_TYPE_KINDS))
            raise reader.error(f"{key}[{index}]", f"unknown layer type {entry!r} (known: {known})")
        kinds.append(kind)
    return kinds


def _layer_kinds(reader: _Reader, layers: int) -> tuple[list[str], bool]:
    """Kind of each layer, and whether the config named sliding layers itself (`layer_types`)."""
    if reader.values.get("layer_types") is not None:
        return _kinds_from_list(reader, "layer_types", layers), True
    if reader.values.get("layers_block_type") is not None:
        return _kinds_from_list(reader, "layers_block_type", layers), False
    pattern = reader.values.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != layers:
            raise reader.error("hybrid_override_pattern", f"must have one character per layer ({layers})")
        unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
        if unknown:
            raise reader.error("hybrid_override_pattern", f"unknown layer character {unknown[0]!r}")
        return [_PATTERN_KINDS[char] for char in pattern], False
    period = reader.optional_int("attn_layer_period")
    if period is not None:  # Jamba: attention where i % period == offset, Mamba elsewhere
        key, offset = reader.find("attn_layer_offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise reader.error(key, f"must be an integer in [0, attn_layer_period), got {offset!r}")
        return [_FULL if i % period == offset else _RECURRENT for i in range(layers)], False
    interval = reader.optional_int("full_attention_interval")
    if interval is not None:  # Qwen3-Next: every interval-th layer is full attention, the rest linear
        return [_FULL if (i + 1) % interval == 0 else _RECURRENT for i in range(layers)], False
    return [_FULL] * layers, False


def _sliding_layers(reader: _Reader, layers: int) -> list[bool]:
    """Which attention layers slide, for configs without `layer_types`: say exactly what the
    config's own model code would (Mistral: all; Qwen2: none unless use_sliding_window, then
    layers from max_window_layers on; Gemma 2/3, Cohere 2: (i + 1) % pattern != 0)."""
    if reader.values.get("sliding_window") is None or reader.values.get("use_sliding_window") is False:
        return [False] * layers
    pattern = reader.optional_int("sliding_window_pattern")
    if pattern is None and reader.values.get("use_sliding_window") is True:
        first_sliding = reader.optional_int("max_window_layers", minimum=0)
        if first_sliding is not None:
            return [i >= first_sliding for i in range(layers)]
    if pattern is None:
        pattern = _DEFAULT_SLIDING_PATTERN.get(reader.values.get("model_type"))
    if pattern is None:
        return [True] * layers
    return [(i + 1) % pattern != 0 for i in range(layers)]


def _recurrent_state(reader: _Reader) -> RecurrentState | None:
    """The recurrent layers' state sizes, where the config gives them."""
    if reader.values.get("linear_num_value_heads") is not None:  # Gated DeltaNet (Qwen3-Next)
        key_heads = reader.required_int("linear_num_key_heads")
        value_heads = reader.required_int("linear_num_value_heads")
        key_dim = reader.required_int("linear_key_head_dim")
        value_dim = reader.required_int("linear_value_head_dim")
        return RecurrentState(
            kind="gated_deltanet",
            conv_kernel=reader.required_int("linear_conv_kernel_dim"),
            conv_channels=2 * key_heads * key_dim + value_heads * value_dim,
            heads=value_heads,
            elements_per_head=key_dim * value_dim,
        )
    if reader.find("mamba_num_heads", "mamba_n_heads")[1] is not None:  # Mamba2 (Nemotron-H, Granite 4)
        heads = reader.required_int("mamba_num_heads", "mamba_n_heads")
        head_dim = reader.required_int("mamba_head_dim", "mamba_d_head")
        state_size = reader.required_int("ssm_state_size", "mamba_d_state")
        groups = reader.required_int("n_groups", "mamba_n_groups")
        return RecurrentState(
            kind="mamba2",
            conv_kernel=reader.required_int("conv_kernel", "mamba_d_conv"),
            conv_channels=heads * head_dim + 2 * groups * state_size,
            heads=heads,
            elements_per_head=head_dim * state_size,
            groups=groups,
            channels_per_group=2 * state_size,
        )
    if reader.values.get("mamba_d_state") is not None:  # Mamba1 (Jamba): inner = expand x hidden
        inner = reader.required_int("mamba_expand") * reader.required_int("hidden_size")
        return RecurrentState(
            kind="mamba1",
            conv_kernel=reader.required_int("mamba_d_conv"),
            conv_channels=inner,
            heads=inner,
            elements_per_head=reader.required_int("mamba_d_state"),
        )
    return None


def layout_from_config_json(source: str | Path | Mapping[str, Any]) -> KVLayout:
    """A layout from a Hugging Face config.json: a path (file or snapshot directory) or the
    loaded dict. Multimodal configs that nest the language model under `text_config` work too."""
    config = _load_config(source)
    top = _Reader(config)
    reader = top
    if config.get("text_config") is not None:
        if not isinstance(config["text_config"], Mapping):
            raise top.error("text_config", "must be an object")
        reader = _Reader(config["text_config"], "text_config.")
    layers = reader.required_int("num_hidden_layers", "n_layer", "num_layers")
    kinds, explicit_sliding = _layer_kinds(reader, layers)
    if not explicit_sliding:
        slides = _sliding_layers(reader, layers)
        kinds = [_SLIDING if kind == _FULL and slide else kind for kind, slide in zip(kinds, slides)]
    sliding_layers = kinds.count(_SLIDING)
    window = reader.optional_int("sliding_window") if sliding_layers else None
    if sliding_layers and window is None:
        raise reader.error("sliding_window", "missing, but layer_types has sliding layers")

    geometry: dict[str, Any] = {}
    if reader.values.get("kv_lora_rank") is not None:  # MLA: one latent + one RoPE key per token
        geometry["mla_latent_dim"] = reader.required_int("kv_lora_rank") + reader.required_int("qk_rope_head_dim")
    else:
        multi_query = reader.values.get("multi_query") is True
        geometry["kv_heads"], geometry["head_dim"] = _kv_geometry(reader, _CONFIG_HEAD_NAMES, multi_query)

    recurrent_layers = kinds.count(_RECURRENT)
    model_dtype = reader.dtype("torch_dtype", "dtype", default=top.dtype("torch_dtype", "dtype", default="bf16"))
    return KVLayout(
        layers=layers,
        full_attention_layers=kinds.count(_FULL),
        sliding_attention_layers=sliding_layers,
        sliding_window=window,
        model_dtype=model_dtype,
        recurrent_layers=recurrent_layers,
        recurrent_state=_recurrent_state(reader) if recurrent_layers else None,
        ssm_state_dtype=reader.dtype("mamba_ssm_cache_dtype", default=AUTO, allow_auto=True),
        **geometry,
    )


# Keys of a target's `model_architecture:` section (docs/kv-math.md explains each).
MAPPING_KEYS = (
    "config_json", "layers", "attention_layers", "recurrent_layers", "attention_heads", "kv_heads",
    "head_dim", "hidden_size", "sliding_window", "sliding_window_layers", "kv_lora_rank",
    "qk_rope_head_dim", "model_dtype", "kv_cache_dtype",
)
# What may accompany config_json: the dtypes a deployment chooses, not the architecture.
_CONFIG_JSON_COMPANIONS = ("model_dtype", "kv_cache_dtype")


def layout_from_mapping(
    values: Mapping[str, Any], base_dir: str | Path | None = None, prefix: str = ""
) -> KVLayout:
    """A layout from explicit numbers (`layers`, `kv_heads`, `head_dim`, ...) or from
    `config_json: path` (relative to base_dir). Error keys start with prefix."""
    if not isinstance(values, Mapping):
        raise ArchitectureError(prefix.rstrip(".") or "model_architecture", "must be a mapping")
    reader = _Reader(values, prefix)
    unknown = [str(key) for key in values if key not in MAPPING_KEYS]  # a YAML key may be a number
    if unknown:
        raise reader.error(unknown[0], f"unknown key (known: {', '.join(MAPPING_KEYS)})")
    overrides = {
        "model_dtype": reader.dtype("model_dtype", default=""),
        "kv_cache_dtype": reader.dtype("kv_cache_dtype", default="", allow_auto=True),
    }
    overrides = {name: value for name, value in overrides.items() if value}

    if values.get("config_json") is not None:
        others = sorted(set(values) - {"config_json", *_CONFIG_JSON_COMPANIONS})
        if others:
            raise reader.error(others[0], "cannot be combined with config_json")
        path = values["config_json"]
        if not isinstance(path, (str, Path)):
            raise reader.error("config_json", f"must be a path, got {path!r}")
        path = Path(path)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        try:
            layout = layout_from_config_json(path)
        except ArchitectureError as err:  # `config_json: <file>: <key in the file>: problem`
            problem = err.problem if err.key == "config_json" else f"{path}: {err}"
            raise reader.error("config_json", problem) from None
        return dataclasses.replace(layout, **overrides)

    layers = reader.required_int("layers")
    recurrent_layers = reader.optional_int("recurrent_layers", minimum=0) or 0
    attention_layers = reader.optional_int("attention_layers") or layers - recurrent_layers
    window = reader.optional_int("sliding_window")
    sliding_layers = reader.optional_int("sliding_window_layers", minimum=0)
    if sliding_layers is None:
        sliding_layers = attention_layers if window is not None else 0
    elif window is None:
        raise reader.error("sliding_window", "missing, but sliding_window_layers is set")
    if sliding_layers > attention_layers:
        raise reader.error(
            "sliding_window_layers", f"{sliding_layers} is more than the {attention_layers} attention layers"
        )
    geometry: dict[str, Any] = {}
    if values.get("kv_lora_rank") is not None or values.get("qk_rope_head_dim") is not None:
        geometry["mla_latent_dim"] = reader.required_int("kv_lora_rank") + reader.required_int("qk_rope_head_dim")
    else:
        geometry["kv_heads"], geometry["head_dim"] = _kv_geometry(reader, _MAPPING_HEAD_NAMES)
    try:
        return KVLayout(
            layers=layers,
            full_attention_layers=attention_layers - sliding_layers,
            sliding_attention_layers=sliding_layers,
            sliding_window=window,
            recurrent_layers=recurrent_layers,
            **geometry,
            **overrides,
        )
    except ArchitectureError as err:
        raise reader.error(err.key, err.problem) from None
