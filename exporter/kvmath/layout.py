"""KV-cache memory arithmetic: what one token, one sequence and one KV budget cost.

Full attention caches a key and a value per layer, per KV head, per token:
    bytes/token = 2 x attention layers x KV heads x head dim x bytes per element.
The variants (MLA latents, sliding windows, hybrid recurrent layers, tensor parallelism) are
documented with worked examples in docs/kv-math.md. A model is described by a `KVLayout`;
every problem with one raises `ArchitectureError`, a ValueError whose text is `key: problem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Bytes per element of each cache dtype, under canonical names.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
# The other spellings that configs (torch_dtype) and engines (--kv-cache-dtype) use.
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}
AUTO = "auto"

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
    if canonical not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES) + ([AUTO] if allow_auto else []))
        raise ArchitectureError(key, f"unknown dtype {name!r} (known: {known})")
    return canonical


def _split(count: int, tp: int, what: str) -> int:
    """count / tp for a dimension that tensor parallelism must split evenly."""
    if count % tp:
        raise ArchitectureError("tp", f"{count} {what} cannot be split evenly over {tp} ranks")
    return count // tp


def require_int(value: Any, key: str, minimum: int = 1) -> int:
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
                require_int(getattr(self, name), name)
        for name in ("full_attention_layers", "sliding_attention_layers", "recurrent_layers"):
            require_int(getattr(self, name), name, minimum=0)
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
        require_int(tp, "tp")
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
        require_int(tp, "tp")
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim  # the latent is replicated on every rank
        return 2 * self.kv_heads_per_gpu(tp) * self.head_dim

    def bytes_per_layer_token(self, kv_cache_dtype: str | None = None, tp: int = 1) -> int:
        return self.elements_per_layer_token(tp) * DTYPE_BYTES[self.resolve_kv_dtype(kv_cache_dtype)]

    def bytes_per_token(self, kv_cache_dtype: str | None = None, tp: int = 1) -> int:
        """KV bytes one more token costs in every attention layer (per GPU when tp > 1).

        Sliding-window layers count too: this is the cost while a sequence is inside the window.
        """
        return self.bytes_per_layer_token(kv_cache_dtype, tp) * self.attention_layers

    def layer_tokens(self, seq_len: int) -> int:
        """Token slots a sequence of seq_len tokens holds, summed over attention layers."""
        require_int(seq_len, "seq_len")
        held_by_sliding = min(seq_len, self.sliding_window) if self.sliding_attention_layers else 0
        return self.full_attention_layers * seq_len + self.sliding_attention_layers * held_by_sliding

    def bytes_per_sequence(self, seq_len: int, kv_cache_dtype: str | None = None, tp: int = 1) -> int:
        """KV bytes of one sequence of seq_len tokens (per GPU when tp > 1); recurrent state apart."""
        return self.bytes_per_layer_token(kv_cache_dtype, tp) * self.layer_tokens(seq_len)

    def recurrent_state_bytes(self, tp: int = 1) -> int | None:
        """Recurrent state of one sequence (per GPU when tp > 1): 0 without recurrent layers,
        None when the model has recurrent layers but its config does not give their sizes."""
        require_int(tp, "tp")
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
        conv_bytes = state.conv_elements(tp) * DTYPE_BYTES[conv_dtype]
        return (conv_bytes + state.ssm_elements(tp) * DTYPE_BYTES[ssm_dtype]) * self.recurrent_layers

    def sequences_in_budget(
        self, budget_bytes: int, seq_len: int, kv_cache_dtype: str | None = None, tp: int = 1
    ) -> int:
        """Concurrent sequences of seq_len tokens that fit in budget_bytes of cache memory.

        With tp > 1 the budget is one GPU's: every rank holds its share of every sequence.
        Each sequence also needs its recurrent state where the config gives its size.
        """
        require_int(budget_bytes, "budget", minimum=0)
        per_sequence = self.bytes_per_sequence(seq_len, kv_cache_dtype, tp) + (self.recurrent_state_bytes(tp) or 0)
        return budget_bytes // per_sequence

    def sequences_in_capacity(self, capacity_tokens: int, seq_len: int) -> int:
        """Concurrent sequences of seq_len tokens in a KV pool of capacity_tokens tokens.

        A pool token is one slot in every attention layer; a sequence takes layer_tokens(seq_len)
        slots, fewer than seq_len per layer where sliding windows cap it. KV only: a token pool
        does not hold recurrent state. Neither the cache dtype nor TP changes the answer.
        """
        require_int(capacity_tokens, "capacity_tokens", minimum=0)
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
