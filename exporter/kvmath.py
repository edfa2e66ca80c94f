"""KV-cache memory arithmetic: what one token, one sequence and one KV budget cost.

Full attention caches a key and a value per layer, per KV head, per token:
    bytes/token = 2 x attention layers x KV heads x head dim x bytes per element.
The variants (MLA latents, sliding windows, hybrid recurrent layers, tensor parallelism) are
documented with worked examples in docs/kv-math.md. A model is described by a `KVLayout`,
built from a Hugging Face config.json (`layout_from_config_json`) or from the explicit numbers of
a target's `model_architecture:` section (`layout_from_mapping`). Every problem with either
raises `ArchitectureError`, a ValueError whose text is `key: problem`.

Stdlib only: the exporter imports this module, and so does `kvcache-exporter kv-math` (`main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping

# Bytes per element of each cache dtype, under canonical names.
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
# The other spellings that configs (torch_dtype) and engines (--kv-cache-dtype) use.
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}
AUTO = "auto"

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


class ArchitectureError(ValueError):
    """A model description that cannot be used. str() is `key: problem`."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def canonical_dtype(name: Any, key: str, allow_auto: bool = False) -> str:
    """The canonical name of a dtype spelling (`bfloat16` -> `bf16`); `auto` only if allowed."""
    if not isinstance(name, str):
        raise ArchitectureError(key, f"must be a dtype name, got {name!r}")
    lowered = name.strip().lower()
    if allow_auto and lowered == AUTO:
        return AUTO
    canonical = _DTYPE_ALIASES.get(lowered, lowered)
    if canonical not in _DTYPE_BYTES:
        known = ", ".join(sorted(_DTYPE_BYTES) + ([AUTO] if allow_auto else []))
        raise ArchitectureError(key, f"unknown dtype {name!r} (known: {known})")
    return canonical


def _split(count: int, tp: int, what: str) -> int:
    """count / tp for a dimension that tensor parallelism must split evenly."""
    if count % tp:
        raise ArchitectureError("tp", f"{count} {what} cannot be split evenly over {tp} ranks")
    return count // tp


def _require_int(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArchitectureError(key, f"must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class RecurrentState:
    """State one sequence holds in each recurrent layer, whatever its length.

    Two tensors, shaped as vLLM allocates them: a causal-convolution state of
    (conv_kernel - 1) x channels, and a recurrent state of `heads` x `elements_per_head`.
    Tensor parallelism splits channels and heads; Mamba2's B/C groups are replicated up to the
    number of ranks when there are fewer groups than ranks.
    """

    kind: str  # "mamba1" (Jamba), "mamba2" (Nemotron-H, Granite 4), "gated_deltanet" (Qwen3-Next)
    conv_kernel: int
    conv_channels: int
    heads: int
    elements_per_head: int
    groups: int = 0  # Mamba2 only
    channels_per_group: int = 0  # Mamba2 only: B and C, 2 x state size

    def conv_elements(self, tp: int = 1) -> int:
        channels = self.conv_channels
        if self.groups and self.groups % tp:
            if tp % self.groups:
                raise ArchitectureError("tp", f"{self.groups} groups cannot be spread over {tp} ranks")
            channels += (tp - self.groups) * self.channels_per_group
        return (self.conv_kernel - 1) * _split(channels, tp, "convolution channels")

    def ssm_elements(self, tp: int = 1) -> int:
        return _split(self.heads, tp, "recurrent state heads") * self.elements_per_head


@dataclass(frozen=True)
class KVLayout:
    """How a model's cache grows: which layers hold KV, how much per token, and per-sequence state.

    `layers` counts every decoder layer; `full_attention_layers` and `sliding_attention_layers`
    hold KV, `recurrent_layers` hold a fixed-size state instead, the rest (MLP-only layers of
    Nemotron-H) hold nothing. An MLA model (`mla_latent_dim` set) caches one latent per layer
    per token, and its `kv_heads` / `head_dim` are unused.
    """

    layers: int
    full_attention_layers: int
    kv_heads: int | None = None
    head_dim: int | None = None
    sliding_attention_layers: int = 0
    sliding_window: int | None = None
    mla_latent_dim: int | None = None
    model_dtype: str = "bf16"
    kv_cache_dtype: str = AUTO
    recurrent_layers: int = 0
    recurrent_state: RecurrentState | None = None
    state_dtype: str = AUTO  # convolution state (and recurrent state unless set); auto = model dtype
    ssm_state_dtype: str = AUTO  # Mamba recurrent state, e.g. float32; auto = state_dtype

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "sliding_window", "mla_latent_dim"):
            if getattr(self, name) is not None:
                _require_int(getattr(self, name), name)
        for name in ("full_attention_layers", "sliding_attention_layers", "recurrent_layers"):
            _require_int(getattr(self, name), name, minimum=0)
        if self.attention_layers < 1:
            raise ArchitectureError("attention_layers", "no layer holds KV")
        if self.attention_layers + self.recurrent_layers > self.layers:
            raise ArchitectureError(
                "layers",
                f"{self.layers} layers cannot hold {self.attention_layers} attention"
                f" and {self.recurrent_layers} recurrent layers",
            )
        if self.sliding_attention_layers and self.sliding_window is None:
            raise ArchitectureError("sliding_window", "missing, but some layers use a sliding window")
        if self.mla_latent_dim is None:
            for name in ("kv_heads", "head_dim"):
                if getattr(self, name) is None:
                    raise ArchitectureError(name, "missing")
        if self.recurrent_state is not None and not self.recurrent_layers:
            raise ArchitectureError("recurrent_layers", "a recurrent state is given but no layer is recurrent")
        # Frozen, so the canonical dtype names go in through object.__setattr__.
        object.__setattr__(self, "model_dtype", canonical_dtype(self.model_dtype, "model_dtype"))
        for name in ("kv_cache_dtype", "state_dtype", "ssm_state_dtype"):
            object.__setattr__(self, name, canonical_dtype(getattr(self, name), name, allow_auto=True))

    @property
    def attention_layers(self) -> int:
        return self.full_attention_layers + self.sliding_attention_layers

    def resolve_kv_dtype(self, kv_cache_dtype: str | None = None) -> str:
        """The cache dtype in force: the argument, else the layout's, with `auto` = model dtype."""
        chosen = canonical_dtype(kv_cache_dtype or self.kv_cache_dtype, "kv_cache_dtype", allow_auto=True)
        return self.model_dtype if chosen == AUTO else chosen

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """KV heads split across TP ranks; with fewer heads than ranks each rank holds a copy of one."""
        _require_int(tp, "tp")
        if self.mla_latent_dim is not None:
            raise ArchitectureError("kv_heads", "an MLA model caches a latent, not KV heads")
        heads = self.kv_heads
        if heads >= tp:
            return _split(heads, tp, "KV heads")
        if tp % heads:
            raise ArchitectureError("tp", f"{heads} KV heads cannot be replicated evenly over {tp} ranks")
        return 1

    def elements_per_layer_token(self, tp: int = 1) -> int:
        """Cached elements of one token in one attention layer, on one GPU."""
        _require_int(tp, "tp")
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim  # the latent is replicated on every rank
        return 2 * self.kv_heads_per_gpu(tp) * self.head_dim

    def bytes_per_layer_token(self, kv_cache_dtype: str | None = None, tp: int = 1) -> int:
        return self.elements_per_layer_token(tp) * _DTYPE_BYTES[self.resolve_kv_dtype(kv_cache_dtype)]

    def bytes_per_token(self, kv_cache_dtype: str | None = None, tp: int = 1) -> int:
        """KV bytes one more token costs in every attention layer (per GPU when tp > 1).

        Sliding-window layers count too: this is the cost while a sequence is inside the window.
        """
        return self.bytes_per_layer_token(kv_cache_dtype, tp) * self.attention_layers

    def layer_tokens(self, seq_len: int) -> int:
        """Token slots a sequence of seq_len tokens holds, summed over attention layers."""
        _require_int(seq_len, "seq_len")
        held_by_sliding = min(seq_len, self.sliding_window) if self.sliding_attention_layers else 0
        return self.full_attention_layers * seq_len + self.sliding_attention_layers * held_by_sliding

    def bytes_per_sequence(self, seq_len: int, kv_cache_dtype: str | None = None, tp: int = 1) -> int:
        """KV bytes of one sequence of seq_len tokens (per GPU when tp > 1); recurrent state apart."""
        return self.bytes_per_layer_token(kv_cache_dtype, tp) * self.layer_tokens(seq_len)

    def recurrent_state_bytes(self, tp: int = 1) -> int | None:
        """Recurrent state of one sequence (per GPU when tp > 1): 0 without recurrent layers,
        None when the model has recurrent layers but its config does not give their sizes."""
        _require_int(tp, "tp")
        if not self.recurrent_layers:
            return 0
        state = self.recurrent_state
        if state is None:
            return None
        conv_dtype = self.model_dtype if self.state_dtype == AUTO else self.state_dtype
        if state.kind == "gated_deltanet" or self.ssm_state_dtype == AUTO:
            ssm_dtype = conv_dtype  # vLLM keeps Gated DeltaNet's state in the conv state's dtype
        else:
            ssm_dtype = self.ssm_state_dtype
        conv_bytes = state.conv_elements(tp) * _DTYPE_BYTES[conv_dtype]
        return (conv_bytes + state.ssm_elements(tp) * _DTYPE_BYTES[ssm_dtype]) * self.recurrent_layers

    def sequences_in_budget(
        self, budget_bytes: int, seq_len: int, kv_cache_dtype: str | None = None, tp: int = 1
    ) -> int:
        """Concurrent sequences of seq_len tokens that fit in budget_bytes of cache memory.

        With tp > 1 the budget is one GPU's: every rank holds its share of every sequence.
        Each sequence also needs its recurrent state where the config gives its size.
        """
        _require_int(budget_bytes, "budget", minimum=0)
        per_sequence = self.bytes_per_sequence(seq_len, kv_cache_dtype, tp) + (self.recurrent_state_bytes(tp) or 0)
        return budget_bytes // per_sequence

    def sequences_in_capacity(self, capacity_tokens: int, seq_len: int) -> int:
        """Concurrent sequences of seq_len tokens in a KV pool of capacity_tokens tokens.

        A pool token is one slot in every attention layer; a sequence takes layer_tokens(seq_len)
        slots, fewer than seq_len per layer where sliding windows cap it. KV only: a token pool
        does not hold recurrent state. Neither the cache dtype nor TP changes the answer.
        """
        _require_int(capacity_tokens, "capacity_tokens", minimum=0)
        return capacity_tokens * self.attention_layers // self.layer_tokens(seq_len)

    def describe(self) -> str:
        """One line: the layers by kind and what one attention layer caches."""
        kinds = [f"{self.full_attention_layers} full attention"] if self.full_attention_layers else []
        if self.sliding_attention_layers:
            kinds.append(f"{self.sliding_attention_layers} sliding window ({self.sliding_window} tokens)")
        if self.recurrent_layers:
            kind = self.recurrent_state.kind if self.recurrent_state else "sizes not given"
            kinds.append(f"{self.recurrent_layers} recurrent ({kind})")
        idle = self.layers - self.attention_layers - self.recurrent_layers
        if idle:
            kinds.append(f"{idle} without cache")
        if self.mla_latent_dim is not None:
            cached = f"MLA latent of {self.mla_latent_dim} per layer"
        else:
            cached = f"{self.kv_heads} KV heads x head dim {self.head_dim}"
        return f"{self.layers} layers: {', '.join(kinds)}; {cached}; model dtype {self.model_dtype}"


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
        return None if value is None else _require_int(value, self.prefix + key, minimum)

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
    unknown = sorted(set(values) - set(MAPPING_KEYS))
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


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in `40GiB`, `80GB`, `512 MiB`, `1.5TiB` or a plain number (decimal units are powers
    of 1000, binary ones of 1024); a fraction of a byte is dropped."""
    match = _SIZE.fullmatch(text)
    unit = match and _SIZE_UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"not a size: {text!r} (write e.g. 40GiB, 80GB, 512MiB)")
    return int(Decimal(match.group(1)) * unit)


def format_bytes(count: int) -> str:
    """`131072` -> `128 KiB`, `70272` -> `68.62 KiB`."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{count} B"
    return f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"


# ---------------------------------------------------------------- kvcache-exporter kv-math

class _UsageError(Exception):
    pass


class _ArgumentParser(argparse.ArgumentParser):
    """Raises instead of printing the usage block and exiting, so main() reports one line."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# CLI flags for the explicit numbers: flag name = mapping key with dashes.
_EXPLICIT_FLAGS = (
    ("layers", "decoder layers"),
    ("attention_layers", "layers that hold KV (default: layers - recurrent layers)"),
    ("recurrent_layers", "Mamba / linear-attention layers (hold a fixed state, no KV)"),
    ("attention_heads", "query heads (KV heads default to it; head dim = hidden size / it)"),
    ("kv_heads", "KV heads (GQA: fewer than attention heads; MQA: 1)"),
    ("head_dim", "head dimension"),
    ("hidden_size", "hidden size (head dim = hidden size / attention heads when not given)"),
    ("sliding_window", "sliding window in tokens"),
    ("sliding_window_layers", "attention layers that use the window (default: all)"),
    ("kv_lora_rank", "MLA compressed KV dimension (DeepSeek V2/V3)"),
    ("qk_rope_head_dim", "MLA decoupled RoPE key dimension"),
)


def _build_parser() -> _ArgumentParser:
    parser = _ArgumentParser(
        prog="kvcache-exporter kv-math",
        description="KV-cache memory arithmetic: bytes per token, per sequence, and how many "
        "sequences fit in a KV budget (docs/kv-math.md).",
    )
    model = parser.add_argument_group("model: a config.json, or explicit numbers")
    model.add_argument("--config-json", metavar="PATH", help="Hugging Face config.json (or its directory)")
    for key, text in _EXPLICIT_FLAGS:
        model.add_argument("--" + key.replace("_", "-"), dest=key, type=_positive_int, metavar="N", help=text)
    model.add_argument("--model-dtype", help="the model's dtype (default: the config's torch_dtype, else bf16)")
    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--dtype", "--kv-cache-dtype", dest="kv_cache_dtype", default=AUTO,
        help="KV cache dtype: auto (= model dtype), bf16, fp16, fp32, fp8, fp8_e4m3, fp8_e5m2, int8",
    )
    serving.add_argument("--state-dtype", help="recurrent state dtype of hybrid models (default: model dtype)")
    serving.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (figures per GPU)")
    serving.add_argument("--seq-len", type=_positive_int, metavar="L", help="tokens per sequence")
    serving.add_argument("--budget", type=_size, metavar="SIZE", help="KV memory per GPU, e.g. 40GiB or 80GB")
    capacity = serving.add_mutually_exclusive_group()
    capacity.add_argument("--capacity-tokens", type=_positive_int, metavar="N", help="KV pool capacity in tokens")
    capacity.add_argument("--target", metavar="URL", help="read the capacity in tokens from a live engine's /metrics")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _layout_from_args(args: argparse.Namespace) -> KVLayout:
    explicit = {key: getattr(args, key) for key, _ in _EXPLICIT_FLAGS if getattr(args, key) is not None}
    if args.config_json and explicit:
        raise _UsageError(f"--config-json cannot be combined with {_flag(next(iter(explicit)))}")
    if not args.config_json and not explicit:
        raise _UsageError("give --config-json PATH, or the model's numbers (--layers, --kv-heads, --head-dim, ...)")
    if args.config_json:
        explicit["config_json"] = args.config_json
    if args.model_dtype:
        explicit["model_dtype"] = args.model_dtype
    layout = layout_from_mapping(explicit)
    if args.state_dtype:
        layout = dataclasses.replace(layout, state_dtype=args.state_dtype)
    return layout


def _flag(key: str) -> str:
    """The command-line flag for a mapping key or argument name (`kv_heads` -> `--kv-heads`)."""
    if key == "kv_cache_dtype":
        return "--dtype"
    return "--" + key.replace("_", "-") if re.fullmatch(r"[a-z_]+", key) else key


def _report(layout: KVLayout, args: argparse.Namespace, capacity_tokens: int | None) -> dict[str, Any]:
    kv_dtype = layout.resolve_kv_dtype(args.kv_cache_dtype)
    tp, seq_len = args.tp, args.seq_len
    report: dict[str, Any] = {
        "layout": dataclasses.asdict(layout),
        "kv_cache_dtype": kv_dtype,
        "bytes_per_element": _DTYPE_BYTES[kv_dtype],
        "tp": tp,
        "bytes_per_token": layout.bytes_per_token(kv_dtype),
        "bytes_per_token_per_gpu": layout.bytes_per_token(kv_dtype, tp),
        "recurrent_state_bytes_per_sequence": layout.recurrent_state_bytes(),
        "recurrent_state_bytes_per_sequence_per_gpu": layout.recurrent_state_bytes(tp),
        "seq_len": seq_len,
        "bytes_per_sequence": None,
        "bytes_per_sequence_per_gpu": None,
        "budget_bytes_per_gpu": args.budget,
        "sequences_in_budget": None,
        "capacity_tokens": capacity_tokens,
        "sequences_in_capacity": None,
    }
    if seq_len is not None:
        report["bytes_per_sequence"] = layout.bytes_per_sequence(seq_len, kv_dtype)
        report["bytes_per_sequence_per_gpu"] = layout.bytes_per_sequence(seq_len, kv_dtype, tp)
        if args.budget is not None:
            report["sequences_in_budget"] = layout.sequences_in_budget(args.budget, seq_len, kv_dtype, tp)
        if capacity_tokens is not None:
            report["sequences_in_capacity"] = layout.sequences_in_capacity(capacity_tokens, seq_len)
    return report


def _human_lines(layout: KVLayout, report: dict[str, Any]) -> list[str]:
    def amount(count: int) -> str:
        return f"{count} ({format_bytes(count)})"

    tp, seq_len = report["tp"], report["seq_len"]
    per_gpu = f" per GPU at TP {tp}"
    lines = [
        f"model: {layout.describe()}",
        f"KV cache dtype: {report['kv_cache_dtype']} ({report['bytes_per_element']} B per element)",
        f"bytes per token: {amount(report['bytes_per_token'])}",
    ]
    if tp > 1:
        lines.append(f"bytes per token{per_gpu}: {amount(report['bytes_per_token_per_gpu'])}")
    if seq_len is not None:
        lines.append(f"bytes per sequence of {seq_len} tokens: {amount(report['bytes_per_sequence'])}")
        if tp > 1:
            lines.append(f"bytes per sequence{per_gpu}: {amount(report['bytes_per_sequence_per_gpu'])}")
    if layout.recurrent_layers:
        state = report["recurrent_state_bytes_per_sequence_per_gpu"]
        where = per_gpu if tp > 1 else ""
        shown = "not given by the config" if state is None else amount(state)
        lines.append(f"recurrent state per sequence{where}: {shown}")
    if report["sequences_in_budget"] is not None:
        where = " per GPU" if tp > 1 else ""
        lines.append(
            f"sequences of {seq_len} tokens in {format_bytes(report['budget_bytes_per_gpu'])}{where}:"
            f" {report['sequences_in_budget']}"
        )
    if report["sequences_in_capacity"] is not None:
        lines.append(
            f"sequences of {seq_len} tokens in {report['capacity_tokens']} tokens of KV capacity:"
            f" {report['sequences_in_capacity']}"
        )
    return lines


def _target_capacity(url: str) -> int:
    from exporter.oneshot import capacity_tokens  # the one-shot poll; only this branch needs it

    return capacity_tokens(url)


def main(argv: list[str]) -> int:
    """`kvcache-exporter kv-math ARGS`: 0 on success, 2 with one line on stderr for bad input,
    1 when a --target cannot be read."""
    prog = "kvcache-exporter kv-math"
    try:
        args = _build_parser().parse_args(argv)
        layout = _layout_from_args(args)
        for flag, value in (("--budget", args.budget), ("--capacity-tokens", args.capacity_tokens),
                            ("--target", args.target)):
            if value is not None and args.seq_len is None:
                raise _UsageError(f"{flag} needs --seq-len")
        # Reject a bad --dtype or a TP that cannot split the cache before polling any target.
        layout.bytes_per_token(args.kv_cache_dtype, args.tp)
        layout.recurrent_state_bytes(args.tp)
        capacity = args.capacity_tokens
        if args.target is not None:
            try:
                capacity = _target_capacity(args.target)
            except Exception as err:  # whatever the poll raises (network, parse): one line, no traceback
                print(f"{prog}: error: --target: {err}", file=sys.stderr)
                return 1
        report = _report(layout, args, capacity)
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except _UsageError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except ArchitectureError as err:
        print(f"{prog}: error: {_flag(err.key)}: {err.problem}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print("\n".join(_human_lines(layout, report)))
    return 0
